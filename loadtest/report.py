"""Benchmark report: runs the scenarios one after another and writes JSON, Markdown and PNG plots.

    python -m loadtest.report                 # full report, ~13 min on 2 cores
    python -m loadtest.report --quick         # smaller cells, ~4 min
    python -m loadtest.report --only faults,routing_decision --out /tmp/r

Scenarios (each through its module's functions, in this process unless noted):
  overhead          loadtest.overhead's Bench: direct backend vs passthrough vs our proxy vs the
                    peer routers found in --peers-venv, interleaved rounds of wrk; plain requests
                    at c=1, 8, 32 (the concurrency sweep) and streaming at c=16.
  affinity          loadtest.affinity's cells (2 shapes x 3 policies x {1, 3} proxies); the
                    per-request TTFT samples are kept for the CDF plot.
  drift             loadtest.affinity_drift's phases back to back on the same running proxies
                    (fresh populations, a popularity swap, a replica joining and one leaving),
                    prefix_affinity and round robin, 1 and 3 proxies; each phase reported.
  lora              loadtest.lora's modes (round_robin, least_loaded, lora_aware).
  faults            4 simulated replicas behind one proxy (least_loaded, first-byte timeout
                    0.5 s, discovery polling every 30 s so retries and passive ejection carry it):
                    healthy, one replica hung (POST /sim/faults {"hang": true}), one SIGKILLed
                    before the load, one SIGKILLed a quarter of the way through it.
  routing_decision  python -m loadtest.routing_decision in a child process (its max-RSS column
                    must not include this process), table parsed.

Output: DIR (default loadtest/results/report-<timestamp>/) with results.json (every number,
raw samples included), summary.md (the tables) and the PNG plots (needs matplotlib: pip install
-e '.[bench]'; without it the plots are skipped and summary.md says so).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import aiohttp

from loadtest import affinity, affinity_drift, lora, overhead
from loadtest.affinity_fleet import HOST, Fleet, SimSettings, free_port

ROOT = Path(__file__).resolve().parents[1]
SCENARIO_NAMES = ["overhead", "affinity", "drift", "lora", "faults", "routing_decision"]
# the overhead concurrency sweep adds c=8 to loadtest.overhead's own scenarios
SWEEP = [("plain_c1", False, 1), ("plain_c8", False, 8), ("plain_c32", False, 32)]
OVERHEAD_SCENARIOS = SWEEP + [s for s in overhead.SCENARIOS if s[0] not in {n for n, _, _ in SWEEP}]

# knobs per mode: quick keeps the whole report under ~6 minutes (~4 measured), full under ~25 (~13)
PRESETS = {
    "quick": {"overhead": {"duration": 3, "rounds": 1, "warmup": 1},
              "affinity": ["--quick"],
              "drift": ["--requests", "300"],
              "lora": {"duration": 8.0},
              "faults": {"requests": 200, "concurrency": 8},
              "routing_decision": {"requests": 2000}},
    "full": {"overhead": {"duration": 5, "rounds": 3, "warmup": 1},
             "affinity": [],
             "drift": [],
             "lora": {"duration": 30.0},
             "faults": {"requests": 1000, "concurrency": 8},
             "routing_decision": {"requests": 20000}},
}


# --- progress bar ---------------------------------------------------------------------------------
class Progress:
    """`[#####.....] 2/5 affinity  1m23s  strong prefix_affinity x3 (5/12)` on stderr.

    On a terminal one line is redrawn in place (and ticks every second); otherwise each update is
    its own line, so logs stay readable."""

    def __init__(self, names: list[str], width: int = 24) -> None:
        self.names, self.width = names, width
        self.index, self.sub, self.detail = 0, 0.0, ""
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        if self.tty:
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self._draw()

    def _line(self) -> str:
        n = len(self.names)
        done = min(1.0, (self.index + self.sub) / n) if n else 1.0
        filled = int(done * self.width)
        elapsed = int(time.monotonic() - self.started)
        name = self.names[self.index] if self.index < n else "done"
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {min(self.index + 1, n)}/{n} {name}"
                f"  {elapsed // 60}m{elapsed % 60:02d}s  {self.detail}").rstrip()

    def _draw(self) -> None:
        with self._lock:
            line = self._line()
            if self.tty:
                cols = 120
                try:
                    cols = os.get_terminal_size(sys.stderr.fileno()).columns or cols
                except OSError:
                    pass
                sys.stderr.write("\r\x1b[2K" + line[:cols - 1])
            else:
                sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def start(self, index: int) -> None:
        self.index, self.sub, self.detail = index, 0.0, "starting"
        self._draw()

    def step(self, done: int, total: int, detail: str) -> None:
        self.sub, self.detail = (done / total if total else 0.0), f"{detail} ({done + 1}/{total})"
        self._draw()

    def note(self, text: str) -> None:
        """A message on its own line, without breaking the bar."""
        with self._lock:
            sys.stderr.write(("\r\x1b[2K" if self.tty else "") + text + "\n")
            sys.stderr.flush()
        if self.tty:
            self._draw()

    def finish(self) -> None:
        self._stop.set()
        self.index, self.sub, self.detail = len(self.names), 0.0, ""
        self._draw()
        if self.tty:
            sys.stderr.write("\n")


def pct(values: list[float], q: float) -> float:
    return affinity.percentile(values, q)


def brief(exc: BaseException) -> str:
    """One line for a failure: the exception's first line and, if it has more (a child's log
    tail), its last line too."""
    return one_line(str(exc)) if str(exc).strip() else type(exc).__name__


def one_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()] or ["?"]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def failure(exc: BaseException, **where) -> dict:
    return {**where, "error": brief(exc), "detail": str(exc)[-3000:]}


# --- overhead ---------------------------------------------------------------------------------
def run_overhead(knobs: dict, ctx: dict, prog: Progress) -> dict:
    overhead.ensure_wrk()
    ns = argparse.Namespace(duration=knobs["duration"], rounds=knobs["rounds"], warmup=knobs["warmup"],
                            only=list(overhead.CONTENDERS), peers_venv=ctx["peers_venv"], peer_policy="round_robin",
                            proxy_workers=0, taskset=False, json=None, backend="fast",
                            access_log=False)
    bench = overhead.Bench(ns)
    contenders, skipped = [], {}
    try:
        backend = bench.start_backend()
        for name in ns.only:
            try:
                c = bench.start(name, backend)
                bench.verify(c)
                contenders.append(c)
            except Exception as exc:  # noqa: BLE001 - a missing peer is skipped with its reason
                skipped[name] = brief(exc)
        cells = [(r, s, c) for r in range(ns.rounds) for s in OVERHEAD_SCENARIOS for c in contenders]
        warm = [(None, s, c) for s in OVERHEAD_SCENARIOS for c in contenders] if ns.warmup else []
        for k, (rnd, (scen, stream, conns), c) in enumerate(warm + cells):
            label = "warm-up" if rnd is None else f"round {rnd + 1}/{ns.rounds}"
            prog.step(k, len(warm) + len(cells), f"{label} {scen} {c.name}")
            if rnd is None:
                bench.wrk(c, stream, conns, ns.warmup)
            else:
                c.results.setdefault(scen, []).append(bench.wrk(c, stream, conns, ns.duration))
    finally:
        bench.close()
    summaries = {c.name: overhead.summarize(c) for c in contenders}
    return {"config": {"duration_s": ns.duration, "rounds": ns.rounds, "warmup_s": ns.warmup, "wrk_threads": 1,
                       "scenarios": [{"name": n, "stream": s, "connections": c} for n, s, c in OVERHEAD_SCENARIOS],
                       "peer_policy": ns.peer_policy},
            "summary": summaries, "skipped": skipped, "raw": {c.name: c.results for c in contenders},
            "table_md": overhead.table(summaries) if "plain_c1" in next(iter(summaries.values()), {}) else ""}


# --- affinity ---------------------------------------------------------------------------------
def redis_reachable(url: str) -> str | None:
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
        return None
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


def run_affinity_cell(shape: str, workload, sizing: dict, policy: str, routers: int, args: argparse.Namespace,
                      tmp: Path) -> dict:
    """affinity.run_cell, keeping the per-request TTFT samples its cell summary drops.

    run_cell calls the module-level `run_load` of loadtest.affinity; for the duration of the
    cell it is wrapped so the LoadResult (with `ttft`, one sample per successful request) is
    kept. Nothing of the affinity modules is copied or edited."""
    captured = []
    original = affinity.run_load

    async def keeping(*a, **kw):
        result = await original(*a, **kw)
        captured.append(result)
        return result

    affinity.run_load = keeping
    try:
        cell = affinity.run_cell(shape, workload, sizing, policy, routers, args, tmp)
    finally:
        affinity.run_load = original
    cell["ttft_ms_samples"] = [round(t * 1000, 3) for t in captured[-1].ttft] if captured else []
    return cell


def run_affinity(argv: list[str], ctx: dict, prog: Progress) -> dict:
    args = affinity.parse_args(argv + ["--peers-venv", ctx["peers_venv"]] +
                               (["--policies", ctx["affinity_policies"]] if ctx["affinity_policies"] else []))
    if args.max_num_seqs is None:  # as affinity.main does
        args.max_num_seqs = max(2, math.ceil(2 * args.concurrency / args.replicas))
    why = redis_reachable(args.redis) if args.redis else None  # default: a private redis-server per cell
    if why:
        raise RuntimeError(f"Redis at {args.redis} is not reachable ({why})")
    tmp = Path(tempfile.mkdtemp(prefix="report-affinity-"))
    policies = affinity.usable_policies(args, tmp)
    counts = [int(x) for x in args.proxies.split(",") if x.strip()]
    shapes = [s.strip() for s in args.shape.split(",") if s.strip()]
    todo = [(s, p, r) for s in shapes for p in policies for r in counts]
    cells, sizings, failures, workloads = [], {}, [], {}
    for k, (shape, policy, routers) in enumerate(todo):
        prog.step(k, len(todo), f"{shape} {policy} x{routers}")
        if shape not in workloads:
            workloads[shape] = affinity.build_shape(shape, args)
            sizings[shape] = workloads[shape][1]
        workload, sizing = workloads[shape]
        try:
            cells.append(run_affinity_cell(shape, workload, sizing, policy, routers, args, tmp))
        except Exception as exc:  # noqa: BLE001 - report the cell and go on, as affinity.main does
            failures.append(failure(exc, shape=shape, policy=policy, routers=routers))
            prog.note(f"[fail] affinity {shape} {policy} x{routers}: {brief(exc)}")
    return {"config": {k: v for k, v in vars(args).items() if k != "json"}, "sizing": sizings, "cells": cells,
            "failures": failures, "logs": str(tmp)}


# --- drift ------------------------------------------------------------------------------------
def run_drift(argv: list[str], ctx: dict, prog: Progress) -> dict:
    """loadtest.affinity_drift's live runs (seed 0), one per policy and proxy count; the installed
    peer routers (cache_aware) beside them, one router each (they share no state)."""
    args = affinity_drift.parse_args(argv + ["--peers-venv", ctx["peers_venv"]])
    tmp = Path(tempfile.mkdtemp(prefix="report-drift-"))
    todo = [(p, int(r)) for p in args.policies.split(",") if p for r in args.proxies.split(",") if r]
    todo += [(f"{peer}:cache_aware", 1) for peer in affinity_drift.PEERS
             if affinity_drift.peer_available(peer, args.peers_venv) is None]
    runs, failures = [], []
    for k, (policy, routers) in enumerate(todo):
        prog.step(k, len(todo), f"{policy} x{routers}")
        try:
            runs.append({"policy": policy, "routers": routers,
                         "phases": affinity_drift.live(args, 0, policy, routers, tmp)})
        except Exception as exc:  # noqa: BLE001 - report the run and go on
            failures.append(failure(exc, policy=policy, routers=routers))
            prog.note(f"[fail] drift {policy} x{routers}: {brief(exc)}")
    return {"config": {k: v for k, v in vars(args).items() if k != "json"}, "runs": runs, "failures": failures,
            "logs": str(tmp)}


# --- lora -------------------------------------------------------------------------------------
def run_lora(knobs: dict, ctx: dict, prog: Progress) -> dict:
    args = lora.parse_args(["--duration", str(knobs["duration"])])
    modes = [m for m in args.modes.split(",") if m]
    results, failures = [], []
    for k, mode in enumerate(modes):
        prog.step(k, len(modes), mode)
        try:
            results.append(lora.run_mode(args, mode))
        except Exception as exc:  # noqa: BLE001
            failures.append(failure(exc, mode=mode))
            prog.note(f"[fail] lora {mode}: {brief(exc)}")
    return {"config": {k: v for k, v in vars(args).items() if k != "json"}, "results": results, "failures": failures}


# --- faults -----------------------------------------------------------------------------------
FAULT_MODEL = "bench-model"
FAULT_CASES = [  # name, what happens
    ("healthy", "4 healthy replicas (baseline)"),
    ("hung", "replica 1 hung before the load: accepts connections, never answers"),
    ("killed", "replica 2 SIGKILLed before the load (the proxy still believes it healthy)"),
    ("killed_mid_run", "replica 2 SIGKILLed after a quarter of the requests were sent"),
]


def fault_proxy_config(port: int, replicas: list[str]) -> str:
    backends = "".join(f'  - {{name: r{i}, url: "{u}"}}\n' for i, u in enumerate(replicas))
    return (f"server: {{host: {HOST}, port: {port}, timeouts: {{first_byte: 0.5}}}}\nbackends:\n{backends}"
            "routing: {policy: least_loaded}\n"
            "discovery: {interval_s: 30, timeout_s: 1, failures_to_down: 1}\n")


def post_json(url: str, body: dict, timeout: float = 5.0) -> dict:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get_text(url: str, timeout: float = 5.0) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


async def fault_load(url: str, requests: int, concurrency: int, kill_at: int | None, kill) -> list[dict]:
    """`requests` chat requests (every other one streaming, 2 tokens) from `concurrency` clients.
    A 200 stream without [DONE] counts as a failure (status 599); a transport error is status 0."""
    out: list[dict] = []
    cursor = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal cursor
        while cursor < requests:
            i = cursor
            cursor += 1
            if kill_at is not None and i == kill_at:
                kill()
            stream = i % 2 == 0
            body = {"model": FAULT_MODEL, "messages": [{"role": "user", "content": f"question {i}"}],
                    "max_tokens": 2, "stream": stream}
            started = time.perf_counter()
            backend = None
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    data = await resp.read()
                    status = resp.status
                    backend = resp.headers.get("x-vllm-proxy-backend")
                    if status == 200 and stream and b"data: [DONE]" not in data:
                        status = 599
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                status = 0
                backend = type(exc).__name__
            out.append({"i": i, "stream": stream, "status": status, "latency_s": time.perf_counter() - started,
                        "backend": backend})

    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return out


def prom_sum(text: str, name: str) -> dict[str, float]:
    """Counter samples of `name` (suffix _total), keyed by their label set."""
    out: dict[str, float] = {}
    for m in re.finditer(rf"^{re.escape(name)}_total(\{{[^}}]*\}})? (\S+)$", text, re.M):
        out[m.group(1) or ""] = out.get(m.group(1) or "", 0.0) + float(m.group(2))
    return out


def run_fault_case(case: str, knobs: dict, tmp: Path) -> dict:
    cell = Path(tempfile.mkdtemp(prefix=f"{case}-", dir=tmp))
    with Fleet(cell) as fleet:
        fleet.start_replicas(4, SimSettings(model=FAULT_MODEL, num_gpu_blocks=4096, itl_ms=10.0, max_num_seqs=16))
        port = free_port()
        cfg = cell / "proxy.yaml"
        cfg.write_text(fault_proxy_config(port, fleet.replicas))
        proxy = fleet.spawn("proxy", [sys.executable, "-m", "proxy", "serve", "--config", str(cfg), "--port", str(port)])
        url = f"http://{HOST}:{port}"
        fleet.wait_ready(proxy, url + "/ready")
        sims = {p.name: p for p in fleet.procs}
        victim = None
        kill_at = None

        def kill() -> None:
            os.killpg(sims["sim2"].popen.pid, signal.SIGKILL)
            sims["sim2"].popen.wait(5)

        if case == "hung":
            victim = 1
            post_json(fleet.replicas[1] + "/sim/faults", {"hang": True})
        elif case == "killed":
            victim = 2
            kill()
        elif case == "killed_mid_run":
            victim = 2
            kill_at = knobs["requests"] // 4
        started = time.perf_counter()
        samples = asyncio.run(fault_load(url, knobs["requests"], knobs["concurrency"], kill_at, kill))
        wall = time.perf_counter() - started
        if case == "hung":
            post_json(fleet.replicas[1] + "/sim/faults", {"hang": False})
        metrics = get_text(url + "/metrics")
        completed = []
        for i, rep in enumerate(fleet.replicas):
            try:
                completed.append(json.loads(get_text(rep + "/sim/stats", timeout=2))["completed"])
            except Exception:  # noqa: BLE001 - the killed replica
                completed.append(None)
    latencies = sorted(s["latency_s"] * 1000 for s in samples)
    failures = [s for s in samples if s["status"] != 200]
    statuses: dict[str, int] = {}
    for s in failures:
        statuses[str(s["status"])] = statuses.get(str(s["status"]), 0) + 1
    return {"case": case, "description": dict(FAULT_CASES)[case], "victim": victim, "requests": len(samples),
            "concurrency": knobs["concurrency"], "failures": len(failures), "failure_statuses": statuses,
            "p50_ms": pct(latencies, 0.5), "p99_ms": pct(latencies, 0.99), "max_ms": latencies[-1] if latencies else None,
            "wall_s": wall, "rps": len(samples) / wall if wall else None,
            "retries": prom_sum(metrics, "vllm_proxy_retries"), "completed_per_replica": completed,
            "latencies_ms": [round(x, 3) for x in latencies]}


def run_faults(knobs: dict, ctx: dict, prog: Progress) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="report-faults-"))
    cases, failures = [], []
    for k, (case, _) in enumerate(FAULT_CASES):
        prog.step(k, len(FAULT_CASES), case)
        try:
            cases.append(run_fault_case(case, knobs, tmp))
        except Exception as exc:  # noqa: BLE001
            failures.append(failure(exc, case=case))
            prog.note(f"[fail] faults {case}: {brief(exc)}")
    return {"config": {**knobs, "replicas": 4, "policy": "least_loaded", "first_byte_timeout_s": 0.5,
                       "discovery_interval_s": 30, "max_tokens": 2, "stream": "every other request",
                       "sim_itl_ms": 10.0},
            "cases": cases, "failures": failures, "logs": str(tmp)}


# --- routing decision -------------------------------------------------------------------------
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\d+)\s*$")


def run_routing_decision(knobs: dict, ctx: dict, prog: Progress) -> dict:
    prog.step(0, 1, f"{knobs['requests']} picks per cell")
    out = subprocess.run([sys.executable, "-m", "loadtest.routing_decision", "--requests", str(knobs["requests"])],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"exit {out.returncode}: {out.stderr[-1000:]}")
    rows, bounded = [], None
    for line in out.stdout.splitlines():
        m = ROW.match(line)
        if m:
            b, idx, n, med, p99, rss = m.groups()
            rows.append({"backends": int(b), "indexed": int(idx), "index_len": int(n), "median_us": float(med),
                         "p99_us": float(p99), "max_rss_mb": int(rss)})
        elif line.startswith("bounded:"):
            bounded = line[len("bounded:"):].strip()
    if not rows:
        raise RuntimeError(f"no table in output:\n{out.stdout[-1000:]}")
    return {"config": knobs, "rows": rows, "bounded": bounded, "stdout": out.stdout}


RUNNERS = {
    "overhead": run_overhead,
    "affinity": run_affinity,
    "drift": run_drift,
    "lora": run_lora,
    "faults": run_faults,
    "routing_decision": run_routing_decision,
}


# --- summary.md -------------------------------------------------------------------------------
def md_table(head: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    right = right if right is not None else set(range(1, len(head)))
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]

    def fmt(r: list) -> str:
        return "| " + " | ".join(str(v).rjust(w) if i in right else str(v).ljust(w)
                                 for i, (v, w) in enumerate(zip(r, widths))) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i in right else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([fmt(head), sep, *map(fmt, rows)])


def fmt_ms(v: float | None, digits: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def section_overhead(r: dict) -> list[str]:
    cfg = r["config"]
    out = [f"Forwarding overhead: every contender in front of the same fast fake backend "
           f"(`loadtest.fast_backend`), wrk -t1, {cfg['rounds']} interleaved round(s) x {cfg['duration_s']} s per "
           f"cell (+{cfg['warmup_s']} s warm-up), medians over rounds. Ratios in parentheses are x direct "
           "(the backend alone); `!` marks a cell with errors.", "", r["table_md"], ""]
    d = r["summary"].get("direct")
    rows = []
    for name, s in r["summary"].items():
        row = [name]
        for scen, _, conns in SWEEP:
            c = s.get(scen)
            if not c:
                row += ["-", "-", "-"]
                continue
            ratio = f" ({c['rps'] / d[scen]['rps']:.2f})" if d and scen in d and not d[scen]["errors"] else ""
            row += [f"{c['rps']:,.0f}{ratio}", f"{c['p50_ms']:.3f}", f"{c['p99_ms']:.2f}"]
        rows.append(row)
    head = ["contender"] + [f"{h} c={c}" for _, _, c in SWEEP for h in ("RPS (x direct)", "p50 ms", "p99 ms")]
    out += ["Concurrency sweep (plain, non-streaming requests):", "", md_table(head, rows), ""]
    if r["skipped"]:
        out += ["Skipped contenders: " + "; ".join(f"{k}: {v}" for k, v in r["skipped"].items()), ""]
    out += ["![overhead vs concurrency](overhead_concurrency.png)", ""]
    return out


def section_affinity(r: dict) -> list[str]:
    cfg = r["config"]
    out = [f"Prefix-affinity quality: {cfg['replicas']} simulated replicas, {cfg['requests']} streaming chat requests "
           f"per cell at concurrency {cfg['concurrency']}, caches cold per cell. *hit*: the fleet's prefix-cache hit "
           "rate (replica counters); *bound*: one pooled LRU cache of the fleet's total size replaying the same "
           "sequence; *share*: hit / bound; *max/mean*: requests on the busiest replica over the mean; TTFT client "
           "side. Several proxies share routing state through Redis and get requests round-robin.", ""]
    for shape, s in r["sizing"].items():
        out.append(f"- shape `{shape}`: {s['tenants']} tenants, Zipf {s['skew']}, top tenant {s['top_tenant_share']:.0%} "
                   f"of requests, {s['tenants_per_replica']} tenants' system prompts fit one replica's cache, "
                   f"{s['continuation_share']:.0%} continuations")
    out.append("")
    rows = []
    for c in r["cells"]:
        rows.append([c["shape"], c["policy"], str(c["routers"]), f"{c['hit_rate']:.3f}", f"{c['bound']:.3f}",
                     f"{c['share_of_bound']:.3f}", f"{c['max_over_mean']:.2f}", fmt_ms(c["ttft_p50_ms"]),
                     fmt_ms(c["ttft_p99_ms"]), str(c["errors"])])
    out += [md_table(["shape", "policy", "proxies", "hit", "bound", "share", "max/mean", "TTFT p50 ms",
                      "TTFT p99 ms", "errors"], rows, right=set(range(2, 10))), ""]
    base = {(c["shape"], c["routers"]): c for c in r["cells"] if c["policy"] == "round_robin"}
    lines = []
    for c in r["cells"]:
        b = base.get((c["shape"], c["routers"]))
        if b is not None and c is not b and b["share_of_bound"] and b["ttft_p50_ms"]:
            share = c["share_of_bound"] / b["share_of_bound"]
            lines.append(f"- {c['shape']} {c['policy']} x{c['routers']}: share {share:.2f}x "
                         f"round robin's, TTFT p50 {c['ttft_p50_ms'] / b['ttft_p50_ms']:.2f}x")
    if lines:
        out += ["Against round robin with the same number of proxies:", "", *lines, ""]
    for f in r.get("failures", []):
        out.append(f"- failed cell {f['shape']} {f['policy']} x{f['routers']}: `{one_line(f['error'])}`")
    if r.get("failures"):
        out.append("")
    out += ["![hit rate vs bound](affinity_hit_rate.png)", "", "![TTFT CDF](affinity_ttft_cdf.png)", "",
            "![load per replica](affinity_load_per_replica.png)", ""]
    return out


def section_drift(r: dict) -> list[str]:
    cfg = r["config"]
    out = [f"Drift: phases of {cfg['requests']} requests back to back on the same running proxies and replicas "
           "(no restart, no Redis flush): " + ", ".join(p.name for p in affinity_drift.PHASES) + " (see "
           "loadtest/affinity_drift.py). Per phase, over all of it including its first requests: *share* of its "
           "own pooled bound (cached prompt tokens from the responses' usage), *max/mean* requests over the live "
           f"replicas, client TTFT; sim latency x{cfg['time_scale']:g}.", ""]
    rows = []
    for run in r["runs"]:
        for ph in run["phases"]:
            rows.append([run["policy"], str(run["routers"]), ph["phase"], f"{ph['share']:.3f}",
                         f"{ph['max_over_mean']:.2f}", fmt_ms(ph["ttft_p50_ms"]), fmt_ms(ph["ttft_p99_ms"]),
                         str(ph["errors"]), " / ".join(map(str, ph["per_replica"]))])
    out += [md_table(["policy", "proxies", "phase", "share", "max/mean", "TTFT p50 ms", "TTFT p99 ms", "errors",
                      "requests per live replica"], rows, right={1, 3, 4, 5, 6, 7}), ""]
    for f in r.get("failures", []):
        out.append(f"- failed run {f['policy']} x{f['routers']}: `{one_line(f['error'])}`")
    return out


def section_lora(r: dict) -> list[str]:
    cfg = r["config"]
    out = [f"LoRA placement: {cfg['adapters']} adapters (Zipf {cfg['skew']}) over {cfg['replicas']} simulated replicas "
           f"with --max-loras {cfg['max_loras']}, resident set {cfg['max_cpu_loras']}, adapter load "
           f"{cfg['lora_load_ms']:g} ms; closed loop of {cfg['concurrency']} streaming clients, {cfg['duration']:g} s "
           f"per mode; simulated delays x{cfg['time_scale']:g}. *reloads*: the replicas' own resident-set misses; "
           "*misrouted*: requests reaching a replica without their adapter (must be 0).", ""]
    rows = []
    for m in r["results"]:
        errors = sum(m["errors"].values()) if m["errors"] else 0
        rows.append([m["mode"], f"{m['rps']:.1f}", fmt_ms(m["ttft_p50_ms"], 0), fmt_ms(m["ttft_p99_ms"], 0),
                     f"{m['loads_per_min']:.1f}", f"{m['unloads_per_min']:.1f}", f"{m['reloads_per_min']:.1f}",
                     str(m["misrouted"]), str(errors), " / ".join(map(str, m["per_replica"]))])
    out += [md_table(["mode", "req/s", "TTFT p50 ms", "TTFT p99 ms", "loads/min", "unloads/min", "reloads/min",
                      "misrouted", "errors", "requests per replica"], rows, right=set(range(1, 9))), ""]
    for f in r.get("failures", []):
        out.append(f"- failed mode {f['mode']}: `{one_line(f['error'])}`")
    return out


def section_faults(r: dict) -> list[str]:
    cfg = r["config"]
    out = [f"Faults: 4 simulated replicas behind one proxy (`least_loaded`, `server.timeouts.first_byte: 0.5`, "
           f"discovery every {cfg['discovery_interval_s']} s so retries and passive ejection do the work), "
           f"{cfg['requests']} chat requests per case from {cfg['concurrency']} clients, every other one streaming, "
           "2 tokens each. A failure is any non-200, a stream without `[DONE]`, or a transport error.", ""]
    rows = []
    for c in r["cases"]:
        retries = sum(c["retries"].values())
        statuses = ", ".join(f"{k}: {v}" for k, v in c["failure_statuses"].items())
        failed = f"{c['failures']}" + (f" ({statuses})" if statuses else "")
        rows.append([c["case"], c["description"], str(c["requests"]), failed,
                     fmt_ms(c["p50_ms"]), fmt_ms(c["p99_ms"]), fmt_ms(c["max_ms"]), f"{retries:.0f}",
                     " / ".join("-" if v is None else str(v) for v in c["completed_per_replica"])])
    out += [md_table(["case", "what", "requests", "failures", "p50 ms", "p99 ms", "max ms", "retries",
                      "completed per replica"], rows, right={2, 4, 5, 6, 7}), ""]
    for f in r.get("failures", []):
        out.append(f"- failed case {f['case']}: `{one_line(f['error'])}`")
    return out


def section_routing(r: dict) -> list[str]:
    rows = [[str(x["backends"]), f"{x['indexed']:,}", f"{x['index_len']:,}", f"{x['median_us']:.1f}",
             f"{x['p99_us']:.1f}", str(x["max_rss_mb"])] for x in r["rows"]]
    out = [f"Routing decision (`PrefixAffinity.pick`, no network, {r['config']['requests']:,} picks per cell, a ~2 KB "
           "system prompt; max RSS is the benchmark process's, cumulative):", "",
           md_table(["backends", "indexed blocks", "index entries", "median µs", "p99 µs", "max RSS MB"], rows), ""]
    if r.get("bounded"):
        out += [f"Bounded: {r['bounded']}", ""]
    return out


SECTIONS = {"overhead": ("Forwarding overhead", section_overhead), "affinity": ("Prefix affinity", section_affinity),
            "drift": ("Prefix affinity under drift", section_drift),
            "lora": ("LoRA placement", section_lora), "faults": ("Faults", section_faults),
            "routing_decision": ("Routing decision", section_routing)}


def summary_md(results: dict, plots: dict) -> str:
    meta = results["meta"]
    out = [f"# Benchmark report ({'quick' if meta['quick'] else 'full'})", "",
           f"- started {meta['started']}, run time {meta['run_time_s'] / 60:.1f} min "
           f"({', '.join(f'{k} {v:.0f} s' for k, v in meta['scenario_times_s'].items())})",
           f"- machine: {meta['cpus']} CPUs ({meta['cpu_model']}), {meta['platform']}, Python {meta['python']}; "
           f"load average before {meta['loadavg_before']}, after {meta['loadavg_after']}",
           f"- commit {meta['git_commit']}{' (working tree modified)' if meta['git_dirty'] else ''}",
           f"- command: `{meta['command']}`",
           "- everything (load generator, proxies, simulated replicas, Redis) shares these CPUs on loopback: "
           "compare rows within a table, not absolute numbers across machines", ""]
    if plots.get("error"):
        out += [f"**Plots not drawn:** {plots['error']}", ""]
    for name, value in results["scenarios"].items():
        title, section = SECTIONS[name]
        out += [f"## {title}", ""]
        if "error" in value:
            out += [f"**Scenario failed:** `{value['error'].strip().splitlines()[-1]}` (traceback in results.json)", ""]
            continue
        out += section(value)
        if out[-1] != "":
            out.append("")
    return "\n".join(out).rstrip() + "\n"


# --- main -------------------------------------------------------------------------------------
def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.report", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="output folder (default loadtest/results/report-<timestamp>/)")
    p.add_argument("--quick", action="store_true", help="smaller cells: the whole report in ~4 minutes")
    p.add_argument("--only", default=",".join(SCENARIO_NAMES), help=f"comma list from {','.join(SCENARIO_NAMES)}")
    p.add_argument("--affinity-policies", help="override the affinity policies (e.g. add sglang:cache_aware)")
    p.add_argument("--peers-venv", default="/tmp/peers-venv", help="venv with vllm-router / sglang-router, if any")
    p.add_argument("--replot", type=Path, metavar="RESULTS_JSON",
                   help="only redraw summary.md and the plots from an earlier results.json (into its folder "
                        "unless --out)")
    args = p.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(SCENARIO_NAMES)
    if unknown:
        p.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; choose from {', '.join(SCENARIO_NAMES)}")
    return args


def write_outputs(results: dict, out: Path) -> dict:
    try:
        from loadtest import report_plots

        plots = report_plots.draw_all(results, out)
    except ImportError as exc:
        plots = {"error": f"{exc} (install the bench extra: pip install -e '.[bench]')"}
    results["plots"] = plots
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "summary.md").write_text(summary_md(results, plots))
    return plots


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.replot:
        results = json.loads(args.replot.read_text())
        out = args.out or args.replot.parent
        out.mkdir(parents=True, exist_ok=True)
        plots = write_outputs(results, out)
        print(f"redrew {out}: {', '.join(sorted(k for k in plots if k != 'error'))}")
        return 0
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = args.out or ROOT / "loadtest" / "results" / f"report-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    preset = PRESETS["quick" if args.quick else "full"]
    ctx = {"peers_venv": args.peers_venv, "affinity_policies": args.affinity_policies}
    names = [n for n in SCENARIO_NAMES if n in args.only]
    meta = {"started": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "quick": args.quick,
            "command": "python -m loadtest.report " + " ".join(argv if argv is not None else sys.argv[1:]),
            "cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
            "python": platform.python_version(), "git_commit": git("rev-parse", "--short", "HEAD"),
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")), "loadavg_before": loadavg(),
            "presets": preset, "scenario_times_s": {}}
    results: dict = {"meta": meta, "scenarios": {}}
    print(f"writing {out}", file=sys.stderr)
    prog = Progress(names)
    started = time.monotonic()
    try:
        for i, name in enumerate(names):
            prog.start(i)
            t0 = time.monotonic()
            try:
                results["scenarios"][name] = RUNNERS[name](preset[name], ctx, prog)
            except (Exception, SystemExit):  # noqa: BLE001 - one broken scenario must not lose the others
                results["scenarios"][name] = {"error": traceback.format_exc()}
                prog.note(f"[fail] {name}: {traceback.format_exc().strip().splitlines()[-1]}")
            meta["scenario_times_s"][name] = time.monotonic() - t0
            prog.note(f"{name} done in {meta['scenario_times_s'][name]:.0f} s")
    except KeyboardInterrupt:
        prog.note("interrupted: writing what was measured so far")
    finally:
        prog.finish()
        meta["run_time_s"] = time.monotonic() - started
        meta["loadavg_after"] = loadavg()
        write_outputs(results, out)
    print(f"report: {out / 'summary.md'} ({meta['run_time_s'] / 60:.1f} min)")
    failed = [n for n, v in results["scenarios"].items() if "error" in v or v.get("failures")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
